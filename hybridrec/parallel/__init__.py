"""hybridrec.parallel"""
