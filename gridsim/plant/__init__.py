"""The physics: one model a file, each pure of I/O and vectorised over racks or domains."""
