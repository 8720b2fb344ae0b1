"""`python -m qwenfast.server [flags]`: the same as `qwenfast serve [flags]`."""

import argparse
import sys

from .options import add_serve_arguments
from .run import serve

if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m qwenfast.server", description="qwenfast image server")
    add_serve_arguments(p)
    sys.exit(serve(p.parse_args()))
