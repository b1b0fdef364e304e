"""Expert parallelism: the experts of every mixture-of-experts layer split over a group of data x context
ranks, the tokens' rows carried to the rank holding their expert by all-to-all and back."""
