"""``lit_gmc fit --config configs/tiny.yaml``: train (LightningCLI); ``lit_gmc export``: checkpoint to HF folder.

A user's mistake (:class:`~lit_gmc.errors.UserError`: an option, a config, data file or checkpoint) prints one
line and exits with status 2; a run stopped by SIGTERM, once it has saved ``last.ckpt``, exits with 143
(128 + SIGTERM, as if the signal had ended it); anything else is a bug and keeps its traceback.
"""

import signal
import sys

from lit_gmc.errors import UserError

PREEMPTED = 128 + signal.SIGTERM


def run(argv: list[str]) -> None:
    """Run ``export`` or the LightningCLI entry point (``fit``, ``validate``, ...) on ``argv``."""
    if argv[:1] == ["export"]:
        from lit_gmc.export import main as export

        export(argv[1:])
        return
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lit_gmc.cli import GMCCLI

    try:
        GMCCLI(args=argv)
    except SIGTERMException:  # a SystemExit without a code, which would exit 0 as if the run had finished
        sys.exit(PREEMPTED)


def main() -> None:
    """``run`` on the command line, with user errors as one line on stderr and exit status 2."""
    try:
        run(sys.argv[1:])
    except Exception as err:
        user_error = user_error_in(err)
        if user_error is None:
            raise
        print(f"lit_gmc: error: {user_error}", file=sys.stderr)
        sys.exit(2)


def user_error_in(err: BaseException) -> UserError | None:
    """``err`` if it is a :class:`UserError`, else the first one it was raised from, else None (a bug).

    jsonargparse wraps the error of a component's constructor (a callback's bad option) in its own. Lightning's
    ``MisconfigurationException`` (an accelerator this machine lacks, a strategy that needs another) is a user's
    error too.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, UserError):
            return err
        if isinstance(err, MisconfigurationException):  # Lightning's word for a trainer option that cannot work here
            return UserError(" ".join(str(err).split()))
        seen.add(id(err))
        err = err.__cause__
    return None


if __name__ == "__main__":
    main()
