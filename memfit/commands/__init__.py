"""One module per ``memfit <verb>``: each turns the parsed arguments into typed values, calls the
library and renders what it returns. Nothing below this package sees argparse."""
