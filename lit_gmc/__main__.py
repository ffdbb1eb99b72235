"""``lit-gmc fit``: train (LightningCLI); ``lit-gmc export``: checkpoint to HF folder; ``lit-gmc estimate``: the lab.

``lit-gmc estimate`` is the estimator lab (:mod:`lit_gmc.lab`).

The command is read before anything heavy is imported, so that ``--help`` answers at once. A user's mistake
(:class:`~lit_gmc.errors.UserError`) prints one line and exits with status 2; a run stopped by SIGTERM, once it has
saved ``last.ckpt``, exits with 143 (128 + SIGTERM); anything else is a bug and keeps its traceback.
"""

import argparse
import difflib
import os
import signal
import sys

import lit_gmc
from lit_gmc.errors import UserError

# Before anything imports TRL, which sets VLLM_LOGGING_LEVEL=ERROR where it is unset: the servers a run launches log
# at the user's level, else INFO (lit_gmc.data.engines.vllm_serve.server_logging_level).
if "trl" not in sys.modules:
    os.environ.setdefault("LIT_GMC_VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))

PREEMPTED = 128 + signal.SIGTERM
COMMANDS = {
    "fit": "train a policy on stale rollouts (lit-gmc fit --help lists its options)",
    "export": "write a checkpoint's policy as a transformers folder (lit-gmc export --help)",
    "estimate": "measure every rule's update against the true gradient under staleness (lit-gmc estimate --help)",
}


def command_parser() -> argparse.ArgumentParser:
    """The parser of ``lit-gmc`` itself: its ``--help`` lists the commands (each command parses its own options)."""
    parser = argparse.ArgumentParser(prog="lit_gmc", description=lit_gmc.__doc__, exit_on_error=False)
    commands = parser.add_subparsers(title="commands", metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def run(argv: list[str]) -> None:
    """Run ``export`` or ``fit`` (the LightningCLI entry point) on ``argv``; ``--help`` alone lists the commands."""
    command = argv[0] if argv else None
    if command == "export":
        from lit_gmc.export import main as export

        export(argv[1:])
    elif command == "estimate":
        from lit_gmc.lab.command import main as estimate

        estimate(argv[1:])
    elif command == "fit":
        fit(argv)
    elif command in ("-h", "--help"):
        command_parser().parse_args(argv)  # prints the help and exits 0
    else:
        raise UserError(unknown_command(command))


def unknown_command(command: str | None) -> str:
    """The message for a missing or unknown command, with the closest one where there is one."""
    if command is None:
        return f"give a command: {' or '.join(COMMANDS)} (lit-gmc --help)"
    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{command} is not a command: one of {', '.join(COMMANDS)} (lit-gmc --help){hint}"


def fit(argv: list[str]) -> None:
    """``lit-gmc fit ...`` through :class:`~lit_gmc.cli.GMCCLI`."""
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

    jsonargparse wraps the error of a component's constructor in its own. Lightning's ``MisconfigurationException``
    (an accelerator this machine lacks, a strategy that needs another) is a user's error too.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, UserError):
            return err
        if is_misconfiguration(err):  # Lightning's word for a trainer option that cannot work here
            return UserError(" ".join(str(err).split()))
        seen.add(id(err))
        err = err.__cause__
    return None


def is_misconfiguration(err: BaseException) -> bool:
    """Whether ``err`` is Lightning's ``MisconfigurationException`` (Lightning is imported only if it was)."""
    module = sys.modules.get("lightning.fabric.utilities.exceptions")
    return module is not None and isinstance(err, module.MisconfigurationException)


if __name__ == "__main__":
    main()
