"""One module per ``engine`` subcommand; see engine/cli.py."""
