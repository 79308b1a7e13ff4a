"""FedSubAvg on Flower with fedsub."""
