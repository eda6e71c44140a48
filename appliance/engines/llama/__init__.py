"""llama"""
