"""Print a run's reward rise from its TensorBoard log: mean of the first and last K steps, and their difference.

    python scripts/reward_rise.py runs/addition_tiny/version_0 [--window 20] [--tag train/reward] [--min-rise 0.1]

With ``--min-rise`` it is a check (CI's, on the default run): exit status 1, with one line, when the rise is below
the bound. A bound, not a value: the default run's records differ between CPUs (their float kernels differ), so
its figures differ too (docs/usage.md gives the ones measured, with the machines).
"""

from __future__ import annotations

import argparse

from lit_gmc.tblog import read_scalars


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logdir", help="a run's log folder (searched recursively for event files)")
    parser.add_argument("--window", type=int, default=20, help="steps averaged at each end")
    parser.add_argument("--tag", default="train/reward", help="scalar to read")
    parser.add_argument("--min-rise", type=float, default=None, help="exit 1 when the rise is below this bound")
    args = parser.parse_args()
    values = [v for _, v in read_scalars(args.logdir)[args.tag]]
    if len(values) < 2 * args.window:
        raise SystemExit(f"{args.logdir}: only {len(values)} steps of {args.tag}, need {2 * args.window}")
    first = sum(values[: args.window]) / args.window
    last = sum(values[-args.window :]) / args.window
    print(f"{args.tag}: {len(values)} steps | first {args.window}: {first:.3f} | last {args.window}: {last:.3f} | "
          f"rise {last - first:+.3f}")  # fmt: skip
    if args.min_rise is not None and last - first < args.min_rise:
        raise SystemExit(f"{args.logdir}: {args.tag} rose {last - first:+.3f}, below --min-rise {args.min_rise:+.3f}")


if __name__ == "__main__":
    main()
