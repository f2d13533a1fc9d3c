"""Tests of engine/cli/: flags, subcommands end to end, the dashboard entry point."""
