"""Request handling: parsing request bodies and reading responses."""
