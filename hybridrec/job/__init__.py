"""What a job config derives before anything trains: its data sources and its embedding tables.

Every process of a job (trainer, PS server, embedding worker) derives these from the config alone
and gets the same answer.
"""
