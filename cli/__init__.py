"""The click front end: parses flags, calls the library, prints. No logic of its own."""
