"""One module per subcommand: `add_parser(subparsers)` and the function it binds."""
