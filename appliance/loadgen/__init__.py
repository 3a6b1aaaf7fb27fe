"""`appliance bench`: a load generator for any deployment of the public API.

The parts: `options` turns the command line into checked settings, `workload` makes the requests,
`runner` sends them (the only part that talks to the network), `stats` computes the figures from
the records, `report` prints and writes them, `plots` draws them.
"""
