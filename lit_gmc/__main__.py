"""``python -m lit_gmc fit --config configs/tiny.yaml``: train with LightningCLI."""

from lit_gmc.cli import GMCCLI


def main() -> None:
    """Run the LightningCLI entry point on the command-line arguments."""
    GMCCLI()


if __name__ == "__main__":
    main()
