"""hybridrec.data"""
