"""Stream backends, one module each (named after the backend); see hybridrec/data/stream/source.py."""
