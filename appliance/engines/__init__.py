"""Inference backends behind one typed Runner contract (:mod:`.runner`), chosen once at load (:mod:`.select`)."""
