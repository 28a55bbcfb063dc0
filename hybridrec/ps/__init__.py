"""hybridrec.ps"""
