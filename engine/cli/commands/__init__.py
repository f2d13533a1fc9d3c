"""One module per ``engine`` subcommand; see engine/cli/main.py."""
