"""The demo model's builder lives in the package now (``exporter/demo_model.py``); this script runs it.

    python samples/demo_model.py OUT_DIR [--mode medusa|eagle|eagle3]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python samples/demo_model.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.demo_model import MODES, Clock, DemoSpec, build_demo_model  # noqa: F401  (old import path)


def main(argv=None) -> Path:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out_dir", type=Path, help="where to save the model_dir")
    ap.add_argument("--mode", choices=sorted(MODES), default="medusa", help="drafter to train")
    args = ap.parse_args(argv)
    return build_demo_model(args.out_dir, mode=args.mode)


if __name__ == "__main__":
    main()
