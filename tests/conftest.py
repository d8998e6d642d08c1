import os
import sys

# Tests import their helpers (_dist, _cases) from this folder.
sys.path.insert(0, os.path.dirname(__file__))
