"""What a run shows: metrics records and their writers, the console's lines and its log format."""
