"""The `adaflash bench` harness: configurations side by side, JSON, Markdown, PNG."""
