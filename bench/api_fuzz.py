"""schemathesis over a real node's whole OpenAPI document, 40 examples per operation
(over 1000 requests): zero 5xx. The logic is exo.devtools.api_fuzz (the suite runs it
with a few examples per operation)."""

from exo.devtools.api_fuzz import main

if __name__ == "__main__":
    main()
