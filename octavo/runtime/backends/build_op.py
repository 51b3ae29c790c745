"""Old name of octavo.build.op (the op's build belongs with the builds): `python -m octavo.runtime.backends.build_op`
still works and every name is re-exported."""
from __future__ import annotations

import sys

from octavo.build.op import *  # noqa: F403
from octavo.build.op import build_library, build_packaged, find_include_dir, main, plan_build  # noqa: F401

if __name__ == "__main__":
    sys.exit(main(prog="python -m octavo.runtime.backends.build_op"))
