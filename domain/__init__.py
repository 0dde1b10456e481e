"""The EPP domain: all logic, standard library and ports only."""
