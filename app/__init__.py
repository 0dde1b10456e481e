"""The composition root: settings, CLI, container and process lifecycle."""
