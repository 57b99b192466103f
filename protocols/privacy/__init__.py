"""Privacy protocols: secure aggregation inside a cell (``secagg``, ``shamir``)."""
