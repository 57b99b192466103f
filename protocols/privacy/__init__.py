"""Privacy protocols: secure aggregation inside a cell (``secagg``, ``shamir``) and differential privacy
(``dp``) with its accountant (``accountant``)."""
