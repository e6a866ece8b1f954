"""The ``kvgraft`` command line: parse, call one library function, render. One module per command group; errors are printed once, in ``app.main``."""
