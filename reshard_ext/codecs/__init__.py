"""Codecs: the Python side of the fused conversions the box kernels run (csrc/kernels/codecs/).

A codec module wraps its kernels and binds its pieces (the TensorRefs whose boxes carry its
codec id and parameters); the transform that decides which tensors convert, and where,
lives beside the other transforms (rx.MXFP8: reshard_ext/mxfp8.py).
"""
