import React from "react";

type Props = { name: string };

export const Hello = ({ name }: Props) => {
  const upper = name.toUpperCase();
  return <div className="hello">Hello {upper}</div>;
};

export default function App() {
  return <Hello name="world" />;
}
