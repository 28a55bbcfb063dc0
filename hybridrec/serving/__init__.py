"""From a trained model to served predictions: `hybridrec export` (a checkpoint of any strategy to
an inference bundle), `hybridrec predict` (a data file scored in a stream), `hybridrec serve` (an
HTTP server, alone or as a Ray Serve deployment, that follows a directory of published versions).
The bundle format itself is hybridrec.bundle; publishing versions while training is
hybridrec.train.publisher."""
