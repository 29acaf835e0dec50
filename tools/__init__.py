"""The command line's commands (tour, bench, ...): above every package, so they may use any."""
