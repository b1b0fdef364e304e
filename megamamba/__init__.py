"""megamamba."""
