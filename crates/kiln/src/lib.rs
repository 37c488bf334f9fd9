pub use burn;
