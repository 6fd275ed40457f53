"""specserve command-line interface (see `specserve --help`)."""
