"""hybridrec.embedding"""
