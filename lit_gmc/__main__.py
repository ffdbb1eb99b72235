"""``python -m lit_gmc fit --config configs/tiny.yaml``: train (LightningCLI); ``export``: checkpoint to HF folder."""

import sys


def main() -> None:
    """Run ``export`` or the LightningCLI entry point (``fit``, ``validate``, ...) on the command-line arguments."""
    if sys.argv[1:2] == ["export"]:
        from lit_gmc.export import main as export

        export(sys.argv[2:])
        return
    from lit_gmc.cli import GMCCLI

    GMCCLI()


if __name__ == "__main__":
    main()
