from reshard_ext import _C  # noqa
