"""hybridrec.comm"""
