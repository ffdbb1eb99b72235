"""YAML configs for LightningCLI, installed as package data so the embedded default ships with the wheel."""
