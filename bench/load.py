"""32 concurrent streaming clients for 60 s on one node this script starts: zero errors,
no task or runner left in /state afterwards, memory growth bounded; prints the figures.
The logic is exo.devtools.load_test (the suite runs a short version of it)."""

from exo.devtools.load_test import main

if __name__ == "__main__":
    main()
