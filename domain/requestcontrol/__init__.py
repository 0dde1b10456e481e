"""Request control: the Director and what it consults for each request.

Import the submodules directly (``domain.requestcontrol.director``, ...); this package
imports nothing eagerly so that plugin modules can depend on its small parts without cycles.
"""
