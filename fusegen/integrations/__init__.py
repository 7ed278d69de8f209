"""fusegen's ops in other libraries' models. Each integration is its own module, imported
only when used: importing fusegen imports none of them, nor the libraries they serve."""
