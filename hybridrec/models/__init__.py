"""hybridrec.models"""
