"""hybridrec: training recommendation models whose embedding tables outgrow one machine."""
__version__ = "0.1.0"
