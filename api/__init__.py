"""Control plane: the command line now; the REST service, job store and scheduler next."""
