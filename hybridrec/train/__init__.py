"""hybridrec.train"""
