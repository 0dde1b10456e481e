"""Request control: the Director and what it consults for each request."""

from domain.requestcontrol.candidates import SUBSET_HINT_KEY, SUBSET_HINT_NAMESPACE, locate
from domain.requestcontrol.director import Director

__all__ = ["SUBSET_HINT_KEY", "SUBSET_HINT_NAMESPACE", "Director", "locate"]
