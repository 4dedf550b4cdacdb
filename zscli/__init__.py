"""The `zeroservice` command line: the local stack (`up`, `down`: Ray and the API as
background processes), the HTTP client of the REST API, the planner's command, the
demo and the PNG reports."""
