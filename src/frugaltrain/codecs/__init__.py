"""Codecs for anything that crosses a link, in three parts:

    grammar.py    the names a config accepts and what each says (no torch: the config and the
                  torch-free control plane import it)
    compress.py   encode and decode a flat tensor in each codec, with honest wire sizes
    feedback.py   error feedback for the codecs that send only part of a payload

This file imports nothing, so importing the grammar does not import torch.
"""
