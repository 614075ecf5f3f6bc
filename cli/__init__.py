"""The `meshlm` command line: `cli.main` dispatches to one module per subcommand (or group of
subcommands); each parses its argv with absl flags and calls library code that parses none."""
