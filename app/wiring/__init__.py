"""The container's factories by subsystem (``app.container`` wires them): each builds one
provider's object from the settings and the objects it depends on."""
