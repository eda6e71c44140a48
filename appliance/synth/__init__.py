"""Synthesis: the decode loop, continuous batching, vocoder windows, the pipeline (text in, PCM chunks out)."""
